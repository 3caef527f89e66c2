"""What is cached and when: manifests, the shard codec, the LMDB regional store."""
