"""moeshard: expert-parallel Mixture-of-Experts inference, every parallel path proven equal to one device."""

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    if name in __all__:  # imported on first use: `import moeshard` stays light
        from moeshard import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'moeshard' has no attribute {name!r}")
