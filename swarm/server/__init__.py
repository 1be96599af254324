"""The stage peer: serves one pipeline stage to trainers and steps with its replicas."""
