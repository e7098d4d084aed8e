from meshbus.cli import main

main()
