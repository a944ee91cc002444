"""What a person reads: the terminal tables and the Markdown and HTML reports (with charts, from
the Jinja template beside them)."""
