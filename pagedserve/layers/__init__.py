"""Building blocks of the decoder: norms, rotary embedding, activations."""
