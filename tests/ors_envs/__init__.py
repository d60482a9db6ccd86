"""ORS environments written the way ORS's users write them (ors-sdk's Environment with @tool methods,
splits and task lists), served by ors-sdk's own Server in the tests: `python -m ors_envs PORT`."""
