"""`python -m asymflash bench`: the benchmark grid, its peers and its report."""
