"""The edge node: gRPC service, origin readers, preprocessing, staging (see issue 3)."""
