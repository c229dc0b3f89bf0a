"""Attention itself: the stage functions, the float64 reference, masks, relations, rotary, the layer."""
