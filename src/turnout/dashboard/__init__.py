"""The dashboard: server-rendered pages (templates/), plain JavaScript and CSS (static/), and the view they show."""
