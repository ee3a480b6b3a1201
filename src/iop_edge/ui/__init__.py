"""The live queue page: ``page`` serves it and its event stream, ``view`` builds what it shows.

The static files (``page.html``, ``app.js``, ``style.css``) live beside these modules.
"""
