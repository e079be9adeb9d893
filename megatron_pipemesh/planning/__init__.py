"""Pure planning layer: cost and memory model, discrete-event simulator, traces and plots."""
