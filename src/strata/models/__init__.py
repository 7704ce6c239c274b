"""Target models: configuration, shared layers, the decoder with feature taps, weight loading."""
