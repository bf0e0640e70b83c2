"""Tools over stores and datasets: verify/info, the Dataset doctor, the demo and synthetic data."""
