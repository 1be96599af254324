"""What training needs beside the model: the data a trainer reads, the optimizer a stage steps, and the
single-process run the swarm is measured against."""
