"""The run's engineering, apart from the algorithm's files: a first reading skips this folder.

What each file holds: the README's table of files; a run's life through them:
docs/runs-that-survive.md."""
