"""stencild service package."""
