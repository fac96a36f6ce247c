"""One module per chapter experiment: its profile table and the runs the chapter shows."""
