"""engine-example-vendor: an example third-party plugin (a simulated device)."""

__version__ = "0.1.0"
