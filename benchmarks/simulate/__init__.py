"""The what-if simulator: a scenario replayed in simulated time through gpupool's own fleet,
admission, picking and rebalancer code, with engines modelled (see `sim` and `model`)."""
