"""Ray cluster configuration for Raymuter (Serve config files): not built yet."""
