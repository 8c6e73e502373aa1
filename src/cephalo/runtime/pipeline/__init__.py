"""Pipeline stages at run time (issue 40): a staged plan's stage runs its units with the
engine's parts on its own ranks (`stage_step`), the order of its micro-batches' forwards and
backwards (`schedule`: GPipe, 1F1B), the boundary activations and gradients re-partitioned
between two stages' batch splits (`exchange`), the stage's and the tied weights' process
groups (`groups`) and a tied parameter whose owner is in another stage (`tie`)."""
