"""One rank's training state: a unit's parameters as a flat buffer and its uneven shards
(`flat`, `unit_shard`), AdamW on the shards (`adamw`) and on their host-held parts
(`host_state`), the frozen base of adapter training (`frozen`), page-locked host memory
(`pinned`), moving the state between plans (`relayout`), the weight-decay rule
(`param_groups`) and the precision policy (`precision`)."""
