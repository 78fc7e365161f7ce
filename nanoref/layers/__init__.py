"""Model layers that work on flat `(N, hidden)` tokens."""
