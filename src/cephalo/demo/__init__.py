"""`cephalo demo`: the zero-argument job (`pipeline`), its values (`result`) and its report."""
