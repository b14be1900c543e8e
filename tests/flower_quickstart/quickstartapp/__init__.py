"""quickstartapp: Flower's PyTorch quickstart, offline."""
