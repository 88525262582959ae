"""moeshard: expert-parallel Mixture-of-Experts inference, every parallel path proven equal to one device."""

__version__ = "0.1.0"
