"""Security at the edge: API keys (auth) and TLS."""
