import socket, sys, time
port, n, t = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
try:
    s = socket.create_server(("", port))
except OSError as e:
    print(f"port {port} is in use ({e.strerror})")
    sys.exit(3)
end, got = time.time() + t, 0
while got < n and time.time() < end:
    s.settimeout(max(0.05, end - time.time()))
    try:
        c, _ = s.accept()
    except OSError:
        break
    got += 1
    c.close()
print(f"accepted {got} of {n}")
sys.exit(0 if got >= n else 4)
