"""Who may link and what they may do: users, permissions and quotas (plain tables),
sign-in, the trust between brokers, TLS accepts and handshakes counted per source."""
