"""int8 and int4 weights: quantizing at convert time, computing with them from a slot."""
