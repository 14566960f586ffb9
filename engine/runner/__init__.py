"""Model execution: the model runner, its forward batch, the overlap worker, sampling, CUDA graphs."""
