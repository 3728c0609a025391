"""Construction of sharded models: ``partitioned()`` shards every module right after its
``__init__``; ``partition_module`` shards a module that exists. Built on ``core``."""
