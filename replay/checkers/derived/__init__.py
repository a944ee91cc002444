"""Derived grades: an answer graded against the reference's answer to the same request, where the
traffic has no labels. ``checker`` chooses the rule and holds the checker the grader's worker
builds (its docstring has the rules); ``rules`` names them; ``values`` compares tool calls and
JSON, ``facts`` the facts of free text, ``code`` finds the code and the calls to run, and
``code_run`` runs them in the sandbox."""
