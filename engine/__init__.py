"""stencild engine package."""
