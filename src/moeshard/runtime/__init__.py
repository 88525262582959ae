"""What every level uses at run time: custom ops and compile-once (graph), the derived-tensor
registry, releasing and re-creating memory. Imports nothing else of moeshard."""
