"""The tiny decoder (no parallel code), its CPU kernels, its data, mixed precision and the one-process
reference run every parallel run is checked against."""
