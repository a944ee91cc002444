"""What ``replay trace anonymize`` replaces and ``replay trace scan`` reports: one table of
detectors (``_table``), used by both, so the two cannot drift.

Detection runs on a folded view of the text (``fold``): characters that NFKC maps to one ASCII
character (full-width ``ｊｏｈｎ＠ｅｘａｍｐｌｅ．ｃｏｍ``, mathematical letters, no-break spaces),
Cyrillic and Greek letters that look like Latin ones, and dash variants are read as their ASCII
look-alike, zero-width characters are skipped, and ``@`` and ``.`` percent-encoded (``%40``,
``%2E``) or written as HTML character references (``&#64;``, ``&#x40;``, ``&commat;``,
``&#46;``, ``&period;``) are read as themselves; spans are mapped back, so the original
characters are what gets replaced, and one value written two ways gets one placeholder.

Kinds (``Finding.kind``), in priority order (an earlier kind wins an overlap):

``pem``              a PEM or PGP armoured block (private keys of any type, certificates):
                     ``-----BEGIN …`` through ``-----END …-----`` when a base64 body (after
                     optional ``Proc-Type:``-style headers) follows the BEGIN line; with no END
                     line (a truncated field), through the end of the text, as when the text
                     ends in the BEGIN line itself (``-----BEGIN RSA PRIV``) or a few base64
                     characters into its body (``...KEY-----\\nMIIBOg``); an END line with the
                     body lines before it (and the tail of a cut BEGIN line, ``IVATE KEY-----``);
                     and body lines alone: a base64 run starting like DER or OpenSSH key data
                     (``MII``/``MIG``/``MHc``/``MC4C``, ``b3BlbnNzaC1rZXkt``) of 40+ characters, or
                     two or more lines of 60-76 base64 characters (the armour's line width).
                     Line breaks may be escaped (``\\n``). Not a block: a marker quoted in code
                     or prose with no body (``b"-----BEGIN OPENSSH PRIVATE KEY-----"``).
``url_credentials``  ``scheme://user:password@host``: the ``user:password`` part.
``jwt``              ``eyJ…`` header, then optionally ``.`` payload and ``.`` signature (a token
                     cut short still counts), whose header decodes to a JSON object with
                     ``"alg"``, or, when the header itself is cut, whose decoded start is
                     ``{"alg"``/``{"typ"``/``{"kid"``… (a pagination cursor is not a JWT).
``api_key``          known prefixes: ``sk-`` (with a digit; 20+ characters, or 6+ at the end of a
                     truncated text), ``sk-proj-``/``sk-ant-`` (6+), ``sk_/pk_/rk_live_|test_``,
                     ``ghp_ gho_ ghu_ ghs_ ghr_``, ``github_pat_``, ``xox[abposr]-``, ``xapp-``,
                     ``AKIA``/``ASIA`` (with a digit), ``AIza``, ``hf_``, ``glpat-``, ``npm_``,
                     ``ya29.``, ``SG.``…``.``…, ``whsec_`` (8+ after most prefixes, so a key cut
                     short is still caught), a Slack webhook path, the token after ``Bearer``
                     (16+ characters with a letter and a digit; 6+ at the end of a truncated
                     text) and the credentials after ``Basic`` (base64 that decodes to printable
                     ``user:password``). A key wrapped at line breaks after its prefix
                     (``sk-proj-abc\\ndef456…``, up to 8 lines) is one key when each next line
                     starts with key material: 8+ characters with a digit or both cases that do
                     not read as words (a random tail of 8 characters is joined ~88% of the
                     time, of 20 ~97%, of 40 ~99%); ``…\\nUse it``, ``…\\nPython3``,
                     ``…\\nx86_64`` end at the break. A break inside the prefix is not joined.
``credential``       a value labelled as a secret: ``?token=…``, ``&sig=…``, ``password=…``,
                     ``pwd: …``, ``"client_secret": "…"``, ``DB_PASSWORD=…``, ``X-Api-Key: …``,
                     ``Authorization: Token …``, ``password := "…"``, and a string under such a key
                     in a JSON object (the value is replaced, the label kept). Labels end in a
                     secret word (``password passwd passphrase pwd secret credentials
                     authorization``…, always; ``token key auth sig signature session sid``: after
                     ``?``/``&``/``;``/``#`` in a URL or a connection string, or after a secret
                     prefix such as ``access_ refresh_ client_ api_ x-amz-``; else only for a
                     value that looks like a key); ``eos_token``, ``max_tokens``, ``sort_key``,
                     ``id_key``, ``monkey`` are not secret labels. Not a value: templates and
                     references (``${X}``, ``<your-key>``, ``%(pw)s``, ``YOUR_API_KEY``,
                     ``$TOKEN``), paths (``pwd: /home/x``), examples (``sk-...``, ``hf_***``,
                     ``my-secret``, ``FOOBAR``, ``123``), names (``"refresh_token"``,
                     ``"X-Access-Token"``), code (``key=lambda…``, ``password=password``,
                     ``token=self.token``, ``key=str.lower``, ``creds = in_memory``,
                     ``private_key: PKCS7PrivateKeyTypes``, ``password: str``), ``None``/
                     ``null``/``redacted``…, and in ``label: value`` form a lone word that is not
                     a whole config line's value (``Password: see the guide``). On ~1.3 M lines
                     of vLLM, transformers, Hugging Face, OpenAI and Anthropic client code, what
                     is left are literal values in examples (``password='IAmSensitive'``).
``email``            ``local@domain.tld`` (Unicode letters allowed: ``用户@例子.广告``, with a CJK
                     top-level domain of 2-5 characters, as the delegated ones are; a Latin one
                     with CJK text glued to it ends where the script changes:
                     ``bob@example.com谢谢``); ``john [at] example [dot] com``,
                     ``jane(at)corp(dot)org``, ``bob@example[.]com``; encoded as a URL or an HTML
                     page writes it (``kim%40example.com``, ``kim&#64;example.com``: the fold
                     above); wrapped at one line break after the ``@`` (``bob@exa\\nmple.com``;
                     where the line before holds a whole address, only when the join makes a
                     common TLD of a cut one, ``bob@example.co\\nm``, so that in
                     ``bob@example.com\\nmore`` the address ends at the break); and at the end
                     of a truncated text ``local@`` with a cut domain (with a Latin letter or
                     digit). Not ``git@host`` (an SSH remote) nor ``name@2x.png`` (an
                     image-density suffix). A break before the ``@`` is not joined
                     (``bo\\nb@example.com`` leaves ``bo``): the word that ends the line before
                     an address cannot be told from a cut local part, and ``ping\\n@alice.dev``
                     is a mention. Unspaced CJK prose that glues a mention to ``.`` and 2-5 CJK
                     characters (``感谢@张三.今天很好``) reads as an address.
``iban``             country code + check digits + BBAN, compact or in groups of four, with the
                     country's registered length and a valid mod-97 checksum; at the end of a
                     truncated text, a grouped IBAN start shorter than its country's length.
``credit_card``      13-19 digits, contiguous or grouped 4-4-4-4(-3) / 4-6-5 / 4-6-4 with one kind
                     of separator (space, dash or dot), a card network's prefix (Visa 4,
                     Mastercard 51-55/2221-2720, Amex 34/37, Discover/UnionPay/Maestro 6,
                     50/56-58, Diners 300-305/36/38/39, JCB 3528-3589) and Luhn-valid; also split
                     across one line break (a wrapped line or a group moved to the next line,
                     not a column of numbers); at the end of a truncated text, 4-4-4(-n) groups
                     with a network prefix. Not after ``-`` (negative).
``ipv6``             ``ipaddress``-valid, at least three groups; not ``::1``/``::``.
``ipv4``             valid octets; not loopback, ``0.0.0.0``, ``255.*`` (netmasks) nor all
                     one-digit octets (``2.6.0.1`` is a version or a section number).
``phone``            9-15 digits: ``+CC`` then groups, ``00`` + a country calling code then
                     groups with one kind of separator (``0049-30-1234567``, ``0049 30
                     1234567``: the placeholder of ``+49 30 1234567``), ``(area) 555-0132``,
                     dashed groups ``415-555-0132``, dotted ``415.555.0132``, or a trunk ``0``
                     then groups separated consistently by spaces or dots (``020 7946 0958``). A
                     bare run of digits, a year, a price, a date, ``415 555 0132`` (spaces, no
                     ``+``/``0``) or a ``00`` number whose code is no country's
                     (``0012-3456-7890``) is not a phone number.
``high_entropy``     a run of 20+ base64/base64url characters (12+ at the end of a truncated
                     text) that mixes upper case, lower case and digits, has Shannon entropy >=
                     min(0.84 * log2(len), 4.4) bits a char, splits into many short pieces (>= 0.3
                     pieces a char; pieces are camelCase words, upper-case runs and digit runs)
                     and does not read as words (< 75% of its letters in ``[A-Z]?[a-z]{2,}``
                     words). Runs are tried per ``/`` segment first, then whole. Or a hex run of
                     32+ chars with letters and digits and entropy >= 3 (hex API keys; also
                     unlabelled hex digests: a digest right after ``sha256:``, ``md5``,
                     ``hash``, ``commit ``, ``/blob/``, ``etag``... is kept). Calibrated on random
                     keys (a random base64 key is caught ~98% of the time at 32 chars, ~92% at
                     20) and on the identifiers in ~40 MB of Python (camelCase model/class names
                     with digits and acronyms such as ``DINOv3ViTBackboneOutput`` are the
                     residual false positives). Not flagged: English words, snake/camel/kebab
                     identifiers, file paths, model names, UUIDs (identifiers, not secrets:
                     lower-case hex with dashes), tool-call ids (``call_``, ``toolu_``,
                     ``chatcmpl-``...) and ``data:…;base64,`` payloads. Base64 of text is flagged
                     like a key (its characters cannot tell them apart).
                     A bare AWS secret access key, exactly 40 characters of ``[A-Za-z0-9+/]``
                     (``wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY``), is taken whole, not per ``/``
                     segment (which left parts of ~40% of random ones), with the tests above but
                     an entropy floor of 4.3 bits a char: ~99.3% of random keys are caught, and
                     none of the 1,639 runs of that shape in ~420 MB of Python, docs and package
                     data. Hex (git SHAs, digests) has at most 4 bits a char and never trips it;
                     the hex rule above applies to it as before.

"The end of a truncated text" is the end of the string, or just before a trailing truncation
mark (``…``, ``...``, ``[truncated]``, ``(+120 chars)``…): what a field cut in the middle of a
secret leaves. Shorter shapes are accepted only there, so ordinary words mid-text are not.

Every regular expression in this package is linear in its input (bounded repetitions, no nested
unbounded quantifiers over overlapping classes); anything that looks backwards or at the end of
the text works on a bounded window.
"""

from replay.tools.pii._reading import PLACEHOLDER, Hit, fold
from replay.tools.pii._table import KINDS, PREFIX, detect

__all__ = ["KINDS", "PLACEHOLDER", "PREFIX", "Hit", "detect", "fold"]
