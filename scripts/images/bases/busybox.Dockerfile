# legorl-base/busybox: stands in for busybox:1.37 where no registry is reachable: Debian's static
# busybox and its applets, alone in an image (the harness images' final stage holds only files).
ARG DEBIAN_IMAGE=legorl-base/debian:bookworm
FROM ${DEBIAN_IMAGE} AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends busybox-static \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /rootfs/bin /rootfs/tmp /rootfs/etc \
 && cp /bin/busybox /rootfs/bin/busybox \
 && for applet in $(/rootfs/bin/busybox --list); do [ "$applet" = busybox ] || ln -s busybox "/rootfs/bin/$applet"; done \
 && chmod 1777 /rootfs/tmp \
 && printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n' > /rootfs/etc/passwd \
 && printf 'root:x:0:\nnobody:x:65534:\n' > /rootfs/etc/group
FROM scratch
COPY --from=build /rootfs /
CMD ["sh"]
