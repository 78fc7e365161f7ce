"""The engine: sequences, paged blocks, the scheduler, the model runner and the step loop."""
