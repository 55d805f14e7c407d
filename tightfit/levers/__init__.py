"""One small module per technique, each applying one choice of a Plan to a model or optimizer."""
