"""`zerolite plan`: a cost model of a run, from the model's config and the machine's measured (or
given) speeds, and the search over policies that chooses one before any weight is read."""
