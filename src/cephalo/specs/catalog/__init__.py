"""The catalog: known GPU types, built-in model shapes and published profiles (`tables`, from
`_data/catalog.json`), consumer cards derived from a measured sibling (`derived`), and FLOP
scaling for models without published profiles (`flop_scaling`)."""
