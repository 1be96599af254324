"""The model a run trains, cut into pipeline stages, and what a stage needs from its device: the stage
architectures, the devices they run on, their memory footprint and the finiteness checks on their tensors."""
