"""pg_dflash worker: DFlash block-diffusion speculative decoding."""

__version__ = "0.2.0"
