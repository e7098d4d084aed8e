"""The mesh of brokers: joining and leaving, gossip, redialling, fencing after a stall,
load balancing and moves, claims, route sync, relayed requests and message groups."""
