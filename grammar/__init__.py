"""stencild grammar package."""
