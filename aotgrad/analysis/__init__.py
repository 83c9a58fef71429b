"""What a traced program does to its inputs and how its outputs alias, as frozen data."""
