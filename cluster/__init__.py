"""Ray cluster configuration for Raymuter: `serve.yaml` (a Serve config file) and its guide, docs/cluster.md."""
