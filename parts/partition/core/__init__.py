"""Core of parts.partition: the sharded-parameter record, gather/release, grad reduce-scatter,
sharding and consolidated state dicts. Knows nothing of modules being built or hooked."""
