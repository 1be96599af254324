"""The model a run trains, cut into pipeline stages, and what a stage needs from its device: the stage
architectures (gpt, llama; ``stages`` picks one), the devices they run on, their memory footprint, the
finiteness checks on their tensors, and whole-model checkpoints in Hugging Face's layout."""
