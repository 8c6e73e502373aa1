"""transformers decoder LMs as units of their own modules (`model`), their families
(`families`), configs (`config`), pretrained weights read one unit at a time (`weights`),
export back to transformers (`export`) and Gemma 3 multimodal directories (`multimodal`)."""
