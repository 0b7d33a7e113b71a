"""zplan: plan, launch and verify sharded data-parallel training."""

__version__ = "0.1.0"
