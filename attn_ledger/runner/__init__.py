"""Running the user's code: the worker process, the tasks it runs, and the reaper of what it starts."""
