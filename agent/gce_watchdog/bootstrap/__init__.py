"""Bootstrap: downloads that survive DNS failures (fetch), job phases, and installation."""
