"""The planner's search for one flat plan: per-rank option tables (`rank_tables`), a rank's
capacity at a step time (`capacity`), the batch split (`batch_split`), water-filling the state
(`water_fill`), the bisection over the step time (`bisection`) and its padded-even variant
(`padded`)."""
